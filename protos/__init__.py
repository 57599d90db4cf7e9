"""Protocol buffer contracts of llmserve; generated modules are regenerated with `make protos`."""
