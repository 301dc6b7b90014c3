"""placeholder during development"""
def add_parser(sub):
    return None
