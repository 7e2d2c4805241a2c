"""The leaf layer: helpers over tensors, ranks and sizes that every other layer uses.
It imports nothing of statepager but the extension."""
