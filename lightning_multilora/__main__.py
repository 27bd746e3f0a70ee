"""``python -m lightning_multilora fit | demo | schedule ...``: the ``multilora`` command."""

from lightning_multilora.cli import main

if __name__ == "__main__":
    main()
