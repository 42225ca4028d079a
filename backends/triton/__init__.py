"""Our own Triton kernels (GQA/MHA and MLA).

Triton is an extra (``pip install 'specdec-conformance[triton]'``): where it is not installed the
backends' modules still import, so ``list`` shows their claims and availability names the
install command; nothing that needs Triton runs there.
"""

INSTALL_HINT = "pip install 'specdec-conformance[triton]'"
# How an MLA KV tile is read (``mla_kernels`` says what the first three are; GLUON is the Gluon
# kernel's TMA ring, ``mla_gluon``): plain ints, so that the claims import without Triton.
GATHER, PAGE, TMA, GLUON = 0, 1, 2, 3
