"""Same-node shared memory: a byte ring (one writer, N readers) and tensor frames by handle.

Internal to :mod:`bus`; the public names are re-exported there.
"""
