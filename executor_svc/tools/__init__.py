"""Build tools outside the serving path: the offline demo checkpoint (``demo_model``)."""
