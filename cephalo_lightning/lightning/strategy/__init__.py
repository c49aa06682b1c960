"""``CephaloStrategy`` and ``CephaloFabricStrategy``: Lightning plumbing over the fit runtime, the
process group and the precision plugins."""
