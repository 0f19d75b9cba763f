"""Sessions and KV accounting: who holds which sequence, per tenant, and how much KV is promised (`table`)."""
