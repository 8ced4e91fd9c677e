"""Search: policies that propose kernels for a problem and learn from the reward."""
