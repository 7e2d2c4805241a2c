"""Checkpoints of attached optimizers: save_load (Pager.save/load), manifest, staging,
dirs. Uses the public interfaces of core only."""
