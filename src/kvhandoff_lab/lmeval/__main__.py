"""`python -m kvhandoff_lab.lmeval ARGS`: lm-eval's command line with the `kvhandoff` model registered."""

from kvhandoff_lab.lmeval import main

main()
