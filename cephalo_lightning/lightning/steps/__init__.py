"""One training step under each schedule (layered, uniform): its state from ``training_step`` to
the end of backward, the step's one all-reduce, and the loss weights of its micro-batches."""
