from lightning_pipe.cli import main

main()
