"""The references stage (`collect`: the target's completion per prompt, checked and cached): decoded locally
(`local`) or asked of a server (`server` over `client`), with the server's own speculative counters (`served`) and
the disk cache (`cache`); multi-turn prompts asked in rounds, each turn after the target's own answer to the
one before (`turns`)."""
