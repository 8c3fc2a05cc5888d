"""The worker SDK (client_sdk): the client against real shards, its wire format, pools,
placement, public surface, and what it does with damaged or hostile replies."""
