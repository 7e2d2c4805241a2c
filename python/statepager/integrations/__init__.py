"""Adapters for other frameworks' optimizers (Megatron-core); each registers itself with
statepager.core.adapters when statepager is imported."""
