import os

# Triton kernels run in the interpreter on machines without a GPU. Must be set before triton
# is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
