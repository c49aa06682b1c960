"""Units of measure every layer shares (torch-free, so the planner can import them)."""

GIB = float(2**30)  # bytes in a GiB, the unit torch.cuda reports and every memory figure here uses


def memory_text(gib: float) -> str:
    """A memory figure (GiB) in the unit that keeps it readable: "20.1 GiB", "23.4 MiB", "512 KiB"
    (an emulated device of 0.02 GiB must not print as "0.0 GiB")."""
    for unit, scale in (("GiB", 1.0), ("MiB", 1024.0), ("KiB", 1024.0**2)):
        if abs(gib) * scale >= 1 or unit == "KiB":
            return f"{gib * scale:.3g} {unit}"
    raise AssertionError("unreachable")
