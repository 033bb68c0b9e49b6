"""`miles-lora-ckpt demo`: ``command`` (its parser and phases), ``slots`` (multi-LoRA), ``reshard`` (a resume
at another layout), ``report`` (what the phases print), ``via_miles*`` (the same through a Miles launch)."""
