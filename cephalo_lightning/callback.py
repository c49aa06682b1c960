"""Kept so that ``cephalo_lightning.callback.CephaloCallback`` (a YAML ``class_path``) still resolves."""

from cephalo_lightning.lightning.callback import CephaloCallback

__all__ = ["CephaloCallback"]
