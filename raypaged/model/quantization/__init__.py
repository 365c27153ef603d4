"""FP8 weights: the schemes raypaged reads (schemes.py), e4m3 arithmetic (numerics.py), the
FP8 product (fp8.py) behind the layers' `LinearMethod` seam (base.py), and the loader's part
(loading.py: quantize at load, or read a checkpoint's FP8 weights and scales per TP rank).

Kept import-light: layers.py imports base.py, and loading.py imports layers.py.
"""
