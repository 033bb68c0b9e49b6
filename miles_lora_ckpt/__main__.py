"""`python -m miles_lora_ckpt` is the `miles-lora-ckpt` command."""

import sys

from miles_lora_ckpt.tools.cli import main

sys.exit(main())
