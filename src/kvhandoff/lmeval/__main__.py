"""`python -m kvhandoff.lmeval ARGS`: lm-eval's command line with the `kvhandoff` model registered."""

from kvhandoff.lmeval import main

main()
