"""CuTe DSL pieces shared by the arch kernels.

compile_cache (explicit-key compile cache, target arch), softmax (online softmax on mma.sync
fragments, exp2), mask (tails, bottom-right causal, windows, key ranges), block_info (key-tile
ranges for tile skipping, CSR rows), seqlen_info (dense / varlen sequence bounds), layouts
(fragment views, swizzled smem tiles).
"""
