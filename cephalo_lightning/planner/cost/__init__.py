"""The cost model: one device kind's time and memory per layer, the collectives' prices, the
cluster's predicted step, and the calibration that corrects them from measured steps."""
