"""Responses kept for `/v1/responses` (`store`): what the gateway stores per organisation,
reads back, continues from (`previous_response_id`), deletes, and what expires."""
