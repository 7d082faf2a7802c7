"""Is the cost model right? Modeled step times beside measured ones on gloo CPU ranks: the whole
step under calibrated and preset profiles, and the overlap of collectives with compute."""
