"""Files of `/v1/files`: what an organisation uploaded (batch input files) and what the
server made for it (batch output and error files), their bytes in the storage under
`files/<org id>/<file id>` and a row each here. The gateway's `/v1/files` and the batch
runner both go through `services.FileService`."""
