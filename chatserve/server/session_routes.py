def session_routes():
    return []  # replaced below once the session store lands
