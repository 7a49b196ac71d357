"""What runs in a step: sequences and sessions, the scheduler, the block manager with its prefix cache."""
