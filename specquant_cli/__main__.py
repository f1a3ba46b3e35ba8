from specquant_cli.cli import main

main()
