from kvhandoff.cli import main

main()
