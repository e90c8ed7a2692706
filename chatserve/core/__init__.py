"""Scheduling and block accounting: requests, sequences, the scheduler, the block manager (plain Python, no torch)."""
