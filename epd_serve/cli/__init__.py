"""The `epd-serve` command: one module per group of subcommands (up, bench, plan, doctor, demo)."""
