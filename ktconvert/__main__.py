from ktconvert.cli import main

main()
