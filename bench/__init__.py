"""dflash.bench: side-by-side measurements (`dflash-bench --help`)."""
