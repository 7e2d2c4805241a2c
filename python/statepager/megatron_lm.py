"""`python -m statepager.megatron_lm pretrain_gpt.py ...`: Megatron-LM's training script
with its optimizer state paged (statepager.integrations.megatron_lm)."""
import sys

from statepager.integrations.megatron_lm import main

if __name__ == "__main__":
    sys.exit(main())
