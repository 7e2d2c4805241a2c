"""The core: Pager, the streamed step of an attached optimizer (stream), scope, guard.
It imports no integration: those reach Pager.attach through core.adapters."""
