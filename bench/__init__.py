"""Benchmarks and the swarm simulator (benchmarks are not tests)."""
