"""placeholder"""
def oip_routes(rt):
    return []
