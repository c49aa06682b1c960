"""Kept so that ``cephalo_lightning.strategy.CephaloStrategy`` (a YAML ``class_path``) still resolves."""

from cephalo_lightning.lightning.strategy import CephaloStrategy

__all__ = ["CephaloStrategy"]
