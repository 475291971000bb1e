from toast.cli import program

program()
