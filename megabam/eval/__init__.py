"""Long-context evaluation. A scoring library that training uses too (passkey.py, niah.py,
perplexity.py, generate.py, figures.py), and above training the commands that read trained runs
(trained.py, cli.py, plots.py, repro.py): docs/design.md, "Floors"."""
