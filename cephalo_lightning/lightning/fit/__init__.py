"""One ``fit``'s runtime: built once the plan is known, with its checkpoints, plan switches,
preemption, run folders, elastic restarts, fault tolerance and the door the callback uses."""
