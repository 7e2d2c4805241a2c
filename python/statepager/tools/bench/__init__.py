"""`statepager bench` commands, one module each; common.py and report.py are shared."""
