"""Device: the CUDA caching allocator replayed over a trace, the device overheads, the GPU and host catalogs.

In: a trace's event stream and a GPU. Out: peak allocated, reserved and device-total bytes; a new GPU is an entry of ``gpus.json``, read by ``gpus.py``.
"""
