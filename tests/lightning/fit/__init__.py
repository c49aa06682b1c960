"""One fit's runtime under failure: preemption, elastic restarts, fault tolerance, run folders."""
