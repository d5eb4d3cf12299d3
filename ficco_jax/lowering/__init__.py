"""How a schedule becomes XLA: `xla` for comm="none"/"xla" (plain JAX collectives and chunked
ppermute steps), `dma` for comm="dma" (the copy-engine FFI executor)."""
