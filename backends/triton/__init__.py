"""Our own Triton kernels (GQA/MHA and MLA).

Triton is an extra (``pip install 'specdec-conformance[triton]'``): where it is not installed the
backends' modules still import, so ``list`` shows their claims and availability names the
install command; nothing that needs Triton runs there.
"""

INSTALL_HINT = "pip install 'specdec-conformance[triton]'"
# How the MLA kernel reads a KV tile (``mla_kernels`` says what each is): plain ints, so that the
# claims import without Triton.
GATHER, PAGE, TMA = 0, 1, 2
