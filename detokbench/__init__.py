"""detokd's benchmark, fuzz, soak and worst-frame tools: `python -m detokbench CMD [args]`.

Not part of the wheel: it runs from a checkout and measures that checkout's detokd.
`python -m detokbench --help` lists the commands (commands.py), one module each
(bench/ is a package). They drive detokd through detokrig, the rig the tests use too:
detokd and its peers, sinks, frames, the corpus, /proc and /metrics readers.
"""
