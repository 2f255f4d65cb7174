"""Worker glue: the FSDP2/DTensor mixin, a tiny pure-torch model and a reference worker."""
