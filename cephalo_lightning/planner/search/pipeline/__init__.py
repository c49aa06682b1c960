"""The pipelined plans' search: stage shapes from the node structure, layer cuts, micro-batch counts."""
