"""`miles-lora-ckpt bench`: ``command`` (its parser, the ratio and mem sections), ``scale``, ``async_save`` and
``distckpt`` (one section each), ``steps`` (the timed steps and worker helpers they share)."""
