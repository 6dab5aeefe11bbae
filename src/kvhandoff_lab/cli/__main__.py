from kvhandoff_lab.cli import main

main()
