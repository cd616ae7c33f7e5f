"""python -m ckptool"""

from ckptool.cli.main import run

if __name__ == "__main__":
    run()
