"""Per-request deadlines: what a timeout may be (``timeouts``), the heap of deadlines and the
feature that ends requests past theirs between two steps (``feature``)."""
